"""Board power and clock control (DVFS governor, sleep, thermal guard).

Built in a later issue; this package already exists so that the distribution's layout is the one
the design card fixes. It must stay free of torch.
"""
