"""The serving engine: requests, the scheduler and its policies, the page pool and its
prefix cache, driving jitted steps of fixed shapes (see docs/architecture.md)."""
