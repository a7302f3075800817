"""Deciding how a launch runs, before anything starts: the caller's :class:`~.plan.LaunchRequest`
checked (``checks``, ``pickling``) and turned into a :class:`~.plan.LaunchPlan` from what this
machine has (``devices``, ``xla``, ``ports``, ``threads``)."""
