"""What the tests share: child-process scripts, classes named by dotted path, the S3 server, data."""
