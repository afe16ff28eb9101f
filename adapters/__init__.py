"""Framework adapters: each turns hooks into StepRecords for the framework-free core."""
