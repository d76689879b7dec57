"""Safe model updates on the device (design section 6).

An update goes ``idle -> downloading -> verifying -> staged -> building-engine -> warming -> canary ->
committed``, journalled so that a crash at any instant restarts on a verified model: the state
machine and its journal, the resumable download, and the steps that stage, warm, canary and commit
a new version beside the one serving.
"""
