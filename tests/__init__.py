"""The test suite. One folder per folder of bridge/ (plus deploy/); shared helpers stay here."""
