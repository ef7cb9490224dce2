"""ninefold.bench"""
