"""What the launcher and the ranks agree on, on the ground floor beside ``wire`` (the frames
both sides write): ``variables`` names every environment variable that crosses, ``precision``
is the one vocabulary of ``mixed_precision``, ``failure`` the record a failed rank sends and the
launcher reads (``kept_frames`` its frames and locals for the debugger, ``bounded`` the pickling
that gives up past a size), ``version`` what both ends of a cluster compare."""
