"""The drafter in other runtimes: exports to formats they load."""
