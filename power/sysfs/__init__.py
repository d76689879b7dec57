"""One small class per sysfs group of a Jetson board (GPU devfreq, CPU cpufreq, EMC, thermal
zones, INA3221 rails, fan, GPU rail-gating), each built from an injected root; and the discovery
that finds their files."""
