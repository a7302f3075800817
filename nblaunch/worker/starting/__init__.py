"""A rank's start inside a process others shaped: state other libraries left in a forked
process (``inherited``), and a meeting point the user's own code names (``own_meeting_point``)."""
