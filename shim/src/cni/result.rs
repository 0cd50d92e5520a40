//! The CNI result, version-independent, rendered in the shape each spec version defines.

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use serde_json::{Map, Value, json};

use super::version_cmp;

/// Also the agent config's `dns` (same keys).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Dns {
    pub nameservers: Vec<String>,
    pub domain: Option<String>,
    pub search: Vec<String>,
    pub options: Vec<String>,
}

/// A JSON list of strings (`null`: empty) at `field`.
pub(super) fn string_list(v: &Value, field: &str) -> Result<Vec<String>, String> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string).ok_or_else(|| format!("{field} must be a list of strings")))
            .collect(),
        _ => Err(format!("{field} must be a list of strings")),
    }
}

impl Dns {
    /// Parse a `dns` object (of a network config or of a result) at `field`.
    pub fn from_json(v: &Value, field: &str) -> Result<Dns, String> {
        let obj = v.as_object().ok_or_else(|| format!("{field} must be an object"))?;
        let nameservers = string_list(obj.get("nameservers").unwrap_or(&Value::Null), &format!("{field}.nameservers"))?;
        for ns in &nameservers {
            ns.parse::<IpAddr>().map_err(|_| format!("{field}.nameservers: {ns:?} is not an IP address"))?;
        }
        let domain = match obj.get("domain") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(format!("{field}.domain must be a string")),
        };
        Ok(Dns {
            nameservers,
            domain,
            search: string_list(obj.get("search").unwrap_or(&Value::Null), &format!("{field}.search"))?,
            options: string_list(obj.get("options").unwrap_or(&Value::Null), &format!("{field}.options"))?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty() && self.domain.is_none() && self.search.is_empty() && self.options.is_empty()
    }
    fn to_json(&self) -> Value {
        let mut m = Map::new();
        if !self.nameservers.is_empty() {
            m.insert("nameservers".into(), json!(self.nameservers));
        }
        if let Some(d) = &self.domain {
            m.insert("domain".into(), json!(d));
        }
        if !self.search.is_empty() {
            m.insert("search".into(), json!(self.search));
        }
        if !self.options.is_empty() {
            m.insert("options".into(), json!(self.options));
        }
        Value::Object(m)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: String,
    pub mtu: Option<u32>,
    /// The netns path for container-side interfaces; None for host-side ones.
    pub sandbox: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpConfig {
    /// Address with its prefix length.
    pub address: IpNetwork,
    pub gateway: Option<IpAddr>,
    pub interface: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: IpNetwork,
    pub gw: Option<IpAddr>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResultModel {
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

fn field_str<'a>(v: &'a Value, key: &str, ctx: &str) -> Result<Option<&'a str>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(format!("{ctx}.{key} must be a string")),
    }
}

impl ResultModel {
    /// Parse a result of any supported version (0.3.0 through 1.1.0).
    pub fn parse(v: &Value) -> Result<Self, String> {
        let mut out = ResultModel::default();
        if let Some(list) = v.get("interfaces") {
            let list = list.as_array().ok_or("interfaces must be a list")?;
            for (i, item) in list.iter().enumerate() {
                let ctx = format!("interfaces[{i}]");
                out.interfaces.push(Interface {
                    name: field_str(item, "name", &ctx)?.ok_or(format!("{ctx}.name is required"))?.to_string(),
                    mac: field_str(item, "mac", &ctx)?.unwrap_or_default().to_string(),
                    mtu: item.get("mtu").and_then(Value::as_u64).map(|m| m as u32),
                    sandbox: field_str(item, "sandbox", &ctx)?.filter(|s| !s.is_empty()).map(str::to_string),
                });
            }
        }
        if let Some(list) = v.get("ips") {
            let list = list.as_array().ok_or("ips must be a list")?;
            for (i, item) in list.iter().enumerate() {
                let ctx = format!("ips[{i}]");
                let addr = field_str(item, "address", &ctx)?.ok_or(format!("{ctx}.address is required"))?;
                let address: IpNetwork =
                    addr.parse().map_err(|_| format!("{ctx}.address {addr:?} is not an address/prefix"))?;
                let gateway = match field_str(item, "gateway", &ctx)? {
                    Some(g) => Some(g.parse().map_err(|_| format!("{ctx}.gateway {g:?} is not an IP"))?),
                    None => None,
                };
                let interface = match item.get("interface") {
                    None | Some(Value::Null) => None,
                    Some(x) => {
                        let idx = x.as_u64().ok_or(format!("{ctx}.interface must be an index"))? as usize;
                        if idx >= out.interfaces.len() {
                            return Err(format!("{ctx}.interface {idx} is out of range"));
                        }
                        Some(idx)
                    }
                };
                out.ips.push(IpConfig { address, gateway, interface });
            }
        }
        if let Some(list) = v.get("routes") {
            let list = list.as_array().ok_or("routes must be a list")?;
            for (i, item) in list.iter().enumerate() {
                let ctx = format!("routes[{i}]");
                let dst = field_str(item, "dst", &ctx)?.ok_or(format!("{ctx}.dst is required"))?;
                let gw = match field_str(item, "gw", &ctx)? {
                    Some(g) => Some(g.parse().map_err(|_| format!("{ctx}.gw {g:?} is not an IP"))?),
                    None => None,
                };
                out.routes
                    .push(Route { dst: dst.parse().map_err(|_| format!("{ctx}.dst {dst:?} is not a CIDR"))?, gw });
            }
        }
        if let Some(d) = v.get("dns").filter(|d| !d.is_null()) {
            out.dns = Dns::from_json(d, "dns")?;
        }
        Ok(out)
    }

    /// Append `other` (this plugin's own work) to a previous result, re-indexing interfaces.
    pub fn chain(mut self, other: ResultModel) -> ResultModel {
        let offset = self.interfaces.len();
        self.interfaces.extend(other.interfaces);
        self.ips.extend(other.ips.into_iter().map(|mut ip| {
            ip.interface = ip.interface.map(|i| i + offset);
            ip
        }));
        self.routes.extend(other.routes);
        if !other.dns.is_empty() {
            self.dns = other.dns;
        }
        self
    }

    /// Render in the shape of `version` (which must be a supported version).
    pub fn render(&self, version: &str) -> Value {
        let legacy = version_cmp(version, "1.0.0").is_lt();
        let with_mtu = version_cmp(version, "1.1.0").is_ge();
        let interfaces: Vec<Value> = self
            .interfaces
            .iter()
            .map(|i| {
                let mut m = Map::new();
                m.insert("name".into(), json!(i.name));
                if !i.mac.is_empty() {
                    m.insert("mac".into(), json!(i.mac));
                }
                if let (true, Some(mtu)) = (with_mtu, i.mtu) {
                    m.insert("mtu".into(), json!(mtu));
                }
                if let Some(s) = &i.sandbox {
                    m.insert("sandbox".into(), json!(s));
                }
                Value::Object(m)
            })
            .collect();
        let ips: Vec<Value> = self
            .ips
            .iter()
            .map(|ip| {
                let mut m = Map::new();
                if legacy {
                    m.insert("version".into(), json!(if ip.address.is_ipv4() { "4" } else { "6" }));
                }
                if let Some(i) = ip.interface {
                    m.insert("interface".into(), json!(i));
                }
                m.insert("address".into(), json!(format!("{}/{}", ip.address.ip(), ip.address.prefix())));
                if let Some(g) = ip.gateway {
                    m.insert("gateway".into(), json!(g.to_string()));
                }
                Value::Object(m)
            })
            .collect();
        let routes: Vec<Value> = self
            .routes
            .iter()
            .map(|r| {
                let mut m = Map::new();
                m.insert("dst".into(), json!(r.dst.to_string()));
                if let Some(g) = r.gw {
                    m.insert("gw".into(), json!(g.to_string()));
                }
                Value::Object(m)
            })
            .collect();
        let mut out = Map::new();
        out.insert("cniVersion".into(), json!(version));
        if !interfaces.is_empty() {
            out.insert("interfaces".into(), Value::Array(interfaces));
        }
        out.insert("ips".into(), Value::Array(ips));
        if !routes.is_empty() {
            out.insert("routes".into(), Value::Array(routes));
        }
        out.insert("dns".into(), self.dns.to_json());
        Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ResultModel {
        ResultModel {
            interfaces: vec![
                Interface { name: "np0".into(), mac: "02:00:00:00:00:01".into(), mtu: Some(1500), sandbox: None },
                Interface {
                    name: "eth0".into(),
                    mac: "02:00:00:00:00:02".into(),
                    mtu: Some(1500),
                    sandbox: Some("/var/run/netns/p".into()),
                },
            ],
            ips: vec![
                IpConfig {
                    address: "10.9.0.5/24".parse().unwrap(),
                    gateway: Some("10.9.0.1".parse().unwrap()),
                    interface: Some(1),
                },
                IpConfig {
                    address: "fd00::5/64".parse().unwrap(),
                    gateway: Some("fd00::1".parse().unwrap()),
                    interface: Some(1),
                },
            ],
            routes: vec![Route { dst: "0.0.0.0/0".parse().unwrap(), gw: Some("10.9.0.1".parse().unwrap()) }],
            dns: Dns { nameservers: vec!["10.96.0.10".into()], ..Default::default() },
        }
    }

    #[test]
    fn renders_each_version_and_round_trips() {
        let r = sample();
        for v in crate::cni::SUPPORTED_VERSIONS {
            let out = r.render(v);
            assert_eq!(out["cniVersion"], *v);
            let legacy = version_cmp(v, "1.0.0").is_lt();
            assert_eq!(out["ips"][0].get("version").is_some(), legacy, "{v}");
            assert_eq!(out["interfaces"][0].get("mtu").is_some(), *v == "1.1.0", "{v}");
            assert_eq!(out["ips"][1]["address"], "fd00::5/64");
            let back = ResultModel::parse(&out).unwrap();
            assert_eq!(back.ips, r.ips);
        }
    }

    #[test]
    fn chain_reindexes() {
        let prev = ResultModel {
            interfaces: vec![Interface { name: "x".into(), ..Default::default() }],
            ..Default::default()
        };
        let c = prev.chain(sample());
        assert_eq!(c.interfaces.len(), 3);
        assert_eq!(c.ips[0].interface, Some(2));
    }

    #[test]
    fn rejects_bad_prev_result() {
        let bad = json!({"ips":[{"address":"10.0.0.1/24","interface":3}]});
        assert!(ResultModel::parse(&bad).unwrap_err().contains("out of range"));
        let bad = json!({"ips":[{"address":"nope"}]});
        assert!(ResultModel::parse(&bad).is_err());
    }
}
