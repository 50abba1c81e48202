"""Tools around kvgate, not part of it: ``kvgate demo`` (a simulated fleet on loopback), the
process supervisor the demo, the tests and the benchmarks share, a throwaway redis-server and the
featurizer benchmark. Installed by the same distribution (so that ``kvgate demo`` works from a
checkout) but left out of the gateway image: they read the repository's assets (docs/architecture.md).
"""
