"""What several balancers share: packing, assignment, CP sizes, bounds and pricing, block
placement and layouts, waves of groups, solver deadlines. Pure functions on plain data; no
module here registers a balancer."""
