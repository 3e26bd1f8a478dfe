//! A real Redis Cluster on free ports of 127.0.0.1: three primaries, each with one
//! replica, so that a killed primary fails over (node timeout 1 s), or three primaries
//! alone.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

use super::redis_server::{cli, info, RedisServer};

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts six nodes, joins them with `redis-cli --cluster create`, and waits until
    /// every node reports `cluster_state:ok` and every replica is in sync (a replica
    /// that never synced refuses to take over).
    pub fn start() -> Self {
        Self::start_with(1)
    }

    /// Starts three primaries and no replicas: quicker, for tests that do not fail
    /// a primary over.
    pub fn start_primaries() -> Self {
        Self::start_with(0)
    }

    fn start_with(replicas_each: usize) -> Self {
        let nodes: Vec<_> = (0..3 * (1 + replicas_each))
            .map(|_| RedisServer::start_cluster_node())
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port()))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args([
                "--cluster-replicas",
                &replicas_each.to_string(),
                "--cluster-yes",
            ])
            .output()
            .expect("running redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let cluster = Self { nodes };
        cluster.wait_until_ok(Duration::from_secs(20));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let synced = cluster
                .nodes
                .iter()
                .map(|node| info(node.port(), "replication"))
                .filter(|replication| replication.contains("role:slave"))
                .filter(|replication| replication.contains("master_link_status:up"))
                .count();
            if synced == 3 * replicas_each {
                return cluster;
            }
            assert!(Instant::now() < deadline, "replicas not in sync after 20 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `redis://` addresses of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A cluster client speaking RESP3 (the backend's subscription needs it).
    pub fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClientBuilder::new(self.urls())
            .use_protocol(redis::ProtocolVersion::RESP3)
            .build()
            .unwrap()
    }

    /// Waits until every running node says the cluster is ok and agrees on three
    /// primaries that each serve slots.
    pub fn wait_until_ok(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let ok = self.running().all(|node| {
                info_cluster(node.port()).contains("cluster_state:ok")
                    && info_cluster(node.port()).contains("cluster_size:3")
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster is not ok after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node that serves `key`'s slot now, by asking a running node.
    pub fn primary_of(&self, key: &str) -> usize {
        let node = self.running().next().expect("a running node");
        let slot = cli(node.port(), &["CLUSTER", "KEYSLOT", key]);
        let slot: u16 = slot.trim().parse().expect("a slot number");
        self.nodes
            .iter()
            .position(|node| {
                node.is_running()
                    && info(node.port(), "replication").contains("role:master")
                    && serves(node.port(), slot)
            })
            .expect("a primary for the slot")
    }

    /// How many clients of the whole cluster subscribe to the shard channel `channel`
    /// (`PUBSUB SHARDNUMSUB` counts one node's own).
    pub fn shard_subscribers(&self, channel: &str) -> usize {
        self.count_subscribers("SHARDNUMSUB", channel)
    }

    /// How many clients of the whole cluster subscribe to the plain channel `channel`.
    pub fn subscribers(&self, channel: &str) -> usize {
        self.count_subscribers("NUMSUB", channel)
    }

    /// `PUBSUB <command> channel` on every running node, summed.
    fn count_subscribers(&self, command: &str, channel: &str) -> usize {
        self.running()
            .map(|node| {
                let reply = cli(node.port(), &["PUBSUB", command, channel]);
                let count = reply.lines().nth(1).unwrap_or("0").trim();
                count.parse::<usize>().expect("a subscriber count")
            })
            .sum()
    }

    /// Moves the slot of `key`, with its keys, from the primary that serves it to the
    /// primary `to`, as `redis-cli --cluster reshard` does for each slot: mark it
    /// importing and migrating, `MIGRATE` its keys, then give it to `to` on both nodes
    /// (the others learn it by gossip).
    pub fn move_slot_of(&self, key: &str, to: usize) {
        let from = self.primary_of(key);
        assert_ne!(from, to, "the slot is on that primary already");
        let (from_port, to_port) = (self.nodes[from].port(), self.nodes[to].port());
        let slot = cli(from_port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .to_owned();
        let from_id = cli(from_port, &["CLUSTER", "MYID"]).trim().to_owned();
        let to_id = cli(to_port, &["CLUSTER", "MYID"]).trim().to_owned();
        let ok = |reply: String| assert_eq!(reply.trim(), "OK", "moving slot {slot}");
        ok(cli(
            to_port,
            &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id],
        ));
        ok(cli(
            from_port,
            &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id],
        ));
        loop {
            let keys = cli(from_port, &["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let port = to_port.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(&keys);
            ok(cli(from_port, &args));
        }
        ok(cli(to_port, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]));
        ok(cli(
            from_port,
            &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id],
        ));
    }

    /// The running primaries.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].is_running()
                    && info(self.nodes[i].port(), "replication").contains("role:master")
            })
            .collect()
    }

    /// Kills every node (SIGKILL).
    pub fn stop_all(&mut self) {
        for node in &mut self.nodes {
            if node.is_running() {
                node.stop();
            }
        }
    }

    fn running(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().filter(|node| node.is_running())
    }
}

fn info_cluster(port: u16) -> String {
    cli(port, &["CLUSTER", "INFO"])
}

/// Whether the node on `port` lists `slot` among its own in `CLUSTER NODES`.
fn serves(port: u16, slot: u16) -> bool {
    let nodes = cli(port, &["CLUSTER", "NODES"]);
    let Some(myself) = nodes.lines().find(|line| line.contains("myself")) else {
        return false;
    };
    myself.split_whitespace().skip(8).any(|range| {
        let mut bounds = range.split('-');
        let start = bounds.next().and_then(|b| b.parse::<u16>().ok());
        let end = bounds.next().and_then(|b| b.parse::<u16>().ok()).or(start);
        matches!((start, end), (Some(start), Some(end)) if start <= slot && slot <= end)
    })
}
