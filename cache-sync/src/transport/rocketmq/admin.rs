//! The admin client: topic routes, queues, offsets, reachability.

use rocketmq_client_rust::{DefaultMQAdminExt, OffsetAdmin, RouteAdmin, TopicAdmin};
use rocketmq_model::common::message::message_queue::MessageQueue;

use super::*;
use crate::error::{Error, Result};

/// An admin client that is shut down explicitly (its `shutdown` is async).
pub(super) struct Admin(pub(super) Option<DefaultMQAdminExt>);

impl Admin {
    pub(super) fn get(&self) -> &DefaultMQAdminExt {
        self.0.as_ref().expect("admin is present until shut down")
    }

    pub(super) async fn shutdown(&mut self) {
        if let Some(mut a) = self.0.take() {
            a.shutdown().await;
        }
    }
}

pub(super) async fn route(
    admin: &DefaultMQAdminExt,
    topic: &str,
) -> Result<Option<rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData>> {
    match TopicAdmin::examine_topic_route_info(admin, topic.into()).await {
        Ok(Some(r)) if !r.queue_datas.is_empty() => Ok(Some(r)),
        Ok(_) => Ok(None),
        // The name server answers TOPIC_NOT_EXIST with an error.
        Err(e) if e.to_string().to_ascii_lowercase().contains("not exist") => Ok(None),
        Err(e) => Err(err(e)),
    }
}

pub(super) async fn queues_of(admin: &DefaultMQAdminExt, topic: &str) -> Result<Vec<QueueRef>> {
    let Some(route) = route(admin, topic).await? else {
        return Err(Error::disconnected(
            KIND,
            format!("topic {topic} has no route"),
        ));
    };
    let mut queues = Vec::new();
    for qd in &route.queue_datas {
        let broker = qd.broker_name().to_string();
        let Some(addr) = route
            .broker_datas
            .iter()
            .find(|b| b.broker_name().as_str() == broker)
            .and_then(|b| b.broker_addrs().get(&0))
        else {
            continue;
        };
        for id in 0..qd.read_queue_nums() {
            let id = i32::try_from(id).unwrap_or(i32::MAX);
            queues.push(QueueRef {
                mq: MessageQueue::from_parts(topic, broker.as_str(), id),
                addr: addr.to_string(),
                name: partition(&broker, id),
            });
        }
    }
    if queues.is_empty() {
        return Err(Error::disconnected(
            KIND,
            format!("topic {topic} has no readable queue on a master broker"),
        ));
    }
    Ok(queues)
}

impl Inner {
    /// Whether the name server lists one of `brokers` as a master (one
    /// request, however many are asked about): a broker that was restarted
    /// accepts connections a moment before it registers, and until it
    /// registers, its topics' routes may lack it.
    pub(super) async fn registered(&self, brokers: &[&str]) -> bool {
        if brokers.is_empty() {
            return false;
        }
        let Ok(mut admin) = self.admin().await else {
            return false;
        };
        let listed = match RouteAdmin::examine_broker_cluster_info(admin.get()).await {
            Ok(cluster) => cluster.broker_addr_table.iter().flatten().any(|(_, b)| {
                brokers.contains(&b.broker_name().as_str()) && b.broker_addrs().contains_key(&0)
            }),
            Err(_) => false,
        };
        admin.shutdown().await;
        listed
    }
}

/// A plain TCP connect: the broker process accepts connections.
pub(super) async fn reachable(addr: &str) -> bool {
    connect(addr).await.is_some()
}

pub(super) async fn offsets(admin: &DefaultMQAdminExt, q: &QueueRef) -> Result<(i64, i64)> {
    let min = OffsetAdmin::min_offset(
        admin,
        q.addr.as_str().into(),
        q.mq.clone(),
        ADMIN_TIMEOUT_MS,
    )
    .await
    .map_err(err)?;
    let max = OffsetAdmin::max_offset(
        admin,
        q.addr.as_str().into(),
        q.mq.clone(),
        ADMIN_TIMEOUT_MS,
    )
    .await
    .map_err(err)?;
    Ok((min.max(0), max.max(min.max(0))))
}
