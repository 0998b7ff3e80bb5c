"""The words every floor speaks: errors, request and result types, configuration, logs,
metrics, where models come from, the trace format. Floor 0: nothing here imports a part above."""
