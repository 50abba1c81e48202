"""The built-in routing policies; see ``router_policies.registry`` for how they are named."""
