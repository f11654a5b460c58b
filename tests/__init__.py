"""The test suite: ``unit/`` mirrors the package, ``system/`` runs whole jobs, ``helpers/`` serves both."""
