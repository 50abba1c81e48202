"""Live benchmarks of kvgate: index speed and memory, gateway overhead, other routers, live fleet."""
