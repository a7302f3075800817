"""The launcher side: plan, start, supervise and tear down a launch."""
