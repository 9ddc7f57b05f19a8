//! What the hooks counted per service, read for `/stats` and for the traffic feed.

use std::collections::HashSet;

use proxy_common::{
    counters::ServiceCounts,
    limit::CxOpen,
    service::{SERVICE_F_CX_LIMIT, SERVICE_F_DROP, ServiceKey},
};

use super::Publisher;

impl Publisher {
    /// What the hooks counted for the service at `key` since it was first published (summed
    /// over CPUs); zero before its first use, `None` for a service that is not live.
    pub fn service_counts(&self, key: &ServiceKey) -> Option<ServiceCounts> {
        let id = self.live.get(key)?.service.id;
        Some(
            self.svc_counters
                .get(&id, 0)
                .map(|per_cpu| ServiceCounts::sum(per_cpu.iter()))
                .unwrap_or_default(),
        )
    }

    /// The kernel's connection counts of the service at `key`, `None` unless it is live and
    /// limited (`max_connections`).
    pub fn cx_counts(&self, key: &ServiceKey) -> Option<CxOpen> {
        let live = self.live.get(key)?;
        (live.service.flags & SERVICE_F_CX_LIMIT != 0).then(|| self.limits.counts(key))
    }

    /// The connects the kernel dropped for the service at `key` (`drop_overloads`), `None`
    /// unless it is live and dropping.
    pub fn drop_count(&self, key: &ServiceKey) -> Option<u64> {
        let live = self.live.get(key)?;
        (live.service.flags & SERVICE_F_DROP != 0).then(|| self.drops.count(key))
    }

    /// Which of the services at `keys` carried traffic: a connect or datagram sent to a host or
    /// redirected to the proxy. Reads only the counters that exist (the hooks create a
    /// service's entry on its first use), so services nobody dialled cost no `bpf()` call.
    pub fn used(&self, keys: &[ServiceKey]) -> Vec<bool> {
        let counted: HashSet<u32> = self.svc_counters.keys().flatten().collect();
        keys.iter()
            .map(|key| {
                self.live
                    .get(key)
                    .map(|l| l.service.id)
                    .filter(|id| counted.contains(id))
                    .and_then(|id| self.svc_counters.get(&id, 0).ok())
                    .is_some_and(|per_cpu| {
                        let c = ServiceCounts::sum(per_cpu.iter());
                        c.to_host > 0 || c.to_proxy > 0
                    })
            })
            .collect()
    }
}
