"""What methods are built from beyond `hetfl.core`: the method registry every method
registers in, and the parts several methods share (width levels, their assignment,
normalisation and evaluation; architecture choice, grafting and the architecture strategy
of FedFA and its baselines) or that one method's module would otherwise outgrow (DTFL's
tier scheduler, FedGKT's server phase). A top-level module of `hetfl.algorithms` is one
method; nothing here registers one."""
