"""`kvconductor kafka-local`: a real Apache Kafka broker or cluster from Maven Central's
jars (`broker`), with its pom and templates in `resources/kafka/`.
"""
