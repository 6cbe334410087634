"""Rollout: workers that run agent loops against the engines, route requests and score."""
