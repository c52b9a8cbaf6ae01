"""SimPy discrete-event simulator of GPU compute and NCCL collectives (docs/design.md §9).

It runs the `Plan`s of the policy core at 256+ GPU scale to compare policies; it imports the
policy modules of `canzona`, never its runtime.
"""
