"""Which strategy fits and on which GPUs: the memory planner (pure arithmetic) and GPU discovery."""
