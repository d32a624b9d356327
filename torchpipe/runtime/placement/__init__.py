"""Where a stage's calls run: the policy that compares executors, the driver that moves a stage
while it runs, and the costs they read (a call's GIL share, page faults, bytes moved)."""
