"""The engine-neutral checkpoint lifecycle: when, where, commit, pointers, retention, discovery, locks."""
