"""The MindSpore (PyNative) adapter: Cell and optimizer hooks turned into StepRecords."""
