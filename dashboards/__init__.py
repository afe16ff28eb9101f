"""Dashboards: TensorBoard layouts, the trainmon TensorBoard plugin, converters."""
