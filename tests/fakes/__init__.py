"""Stand-ins for what the test machine lacks (a GPU and CuPy), shared by the tests that need them."""
