"""PyTorch adapter: hooks on modules, parameters and the optimizer, turned into StepRecords."""
