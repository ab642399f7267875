"""The driver side: controller, worker group, dispatch, tracking."""
