"""What the tests import: servers, launchers, golden values, simulated jobs."""
