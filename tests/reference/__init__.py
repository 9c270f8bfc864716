"""Registry reference implementations vendored for tests (see each file's header)."""
