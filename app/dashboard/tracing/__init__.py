"""The causal-tracing view: form, live state, heatmap and the Panel component."""
