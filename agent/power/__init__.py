"""Power governance in the daemon (issue 18): the ``[power]`` policy (``policy``), and the
service that runs the governor's controller on a thread of its own beside the serving path,
wakes the board for the batcher and restores the board on shutdown (``service``)."""
