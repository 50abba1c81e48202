"""Pure routing core of kvgate: block keys, the prefix index and the policies.

Nothing in this package does I/O or awaits: the gateway and the offline simulator run the very
same objects.
"""
