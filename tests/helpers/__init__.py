"""Code the tests share, imported as ``helpers.<module>``: pytest puts ``tests/`` on sys.path (rootdir
conftest, default ``prepend`` import mode), and spawned workers get the parent's sys.path, so the same name
resolves in both."""
