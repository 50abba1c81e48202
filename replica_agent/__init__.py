"""kvgate replica agent: engine KV-event subscriber, load probe and inventory stream; and the
simulated engine used by demos, tests and benchmarks."""
