//! The device plane: the device file (`config`: classes, patterns, CDI), and the kubelet
//! device plugins serving them (`deviceplugin`: v1beta1 ListAndWatch, Allocate, the
//! manager's inotify loop). It uses `sys`, `obs`, `rpc` and `kubelet`; never the agent or
//! the other planes.

pub mod config;
pub mod deviceplugin;
