"""The evaluation tests' tiny judge comes from the root conftest (session-scoped ``judge``);
``tests.builders.tiny_judge`` builds one with other settings."""
