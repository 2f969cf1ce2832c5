"""policy_dsl"""
