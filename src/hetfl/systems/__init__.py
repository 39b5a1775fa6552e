"""The systems layer: device profiles, the simulated clock and deadlines, the MAC cost model.

Engine-neutral: the simulator drives its clock with these; both engines count MACs with
`costs.MacCounter`; the config validates `system:` through `profiles`.
"""
