"""The causal-tracing view: form, live state, status, heatmap, downloads and the Panel component."""
