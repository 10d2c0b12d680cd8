"""Helpers shared by e2e tests and benchmark scripts: tiny models, real engine servers, fake servers."""
