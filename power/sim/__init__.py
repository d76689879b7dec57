"""A Jetson board without the hardware: a fake board tree (tree.py), the kernel's rules for writes
into it (kernel.py), strict fake nvpmodel/jetson_clocks runners (commands.py), and the simulator
that drives the tree over simulated time (physics, governors, traces)."""
