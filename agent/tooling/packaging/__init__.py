"""Packaging the daemon as a systemd service: what goes where on a board (layout), installing it
into a root file system for flashing (rootfs), and the Debian package for boards in the field
(deb). tools/install_rootfs.py and tools/build_deb.py are their command lines."""
