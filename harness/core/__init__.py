"""Configuration (ppspec.toml < suite YAML < flags), suites, statistics, tables, prompt formats, the model and draft
cache and file pieces (importing no other part of the harness)."""
