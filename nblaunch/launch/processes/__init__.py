"""The launcher's processes and their pipes (below the starters, importing nothing above)."""
