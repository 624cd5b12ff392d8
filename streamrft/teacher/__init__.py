"""On-policy distillation: a teacher log-prob service and the client the TeacherFetcher stage uses."""
