"""A lab of hosts in network namespaces on one machine, for the mesh-across-hosts stage (tests/netns) and the
hand-off benchmark over a shaped link: ``hosts`` (namespaces, a bridge, tc caps), ``delay_proxy`` (added latency,
which this machine's kernel lacks netem for), ``mesh`` (the kvmesh services placed on those hosts)."""
