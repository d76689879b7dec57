"""The local control channel (design section 5.5): commands on the board (``edge-agent update ...``)
reach the running daemon over a Unix socket in the state directory that only the daemon's user and
root can use."""
