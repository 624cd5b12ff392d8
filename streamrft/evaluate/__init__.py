"""``streamrft eval``: a policy on a benchmark file, n samples per problem, pass@1 / pass@k / maj@k."""
