"""netdsl.runtime"""
