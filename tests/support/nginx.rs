//! nginx as a real origin: a foreground process on loopback ports, with the `server` blocks a
//! test gives it and a directory of its own (its logs, certificates), killed on drop.

use super::*;

use std::path::Path;
use std::time::Instant;

/// A running nginx.
pub struct Nginx {
    /// The addresses its servers listen on, as given to the config.
    pub addrs: Vec<SocketAddr>,
    child: std::process::Child,
    dir: TempDir,
}

impl Nginx {
    /// nginx with the `http` block's contents `servers(addrs, dir)` gives (`server` blocks,
    /// `log_format` and `access_log` lines), listening on `ports` loopback addresses; `None`
    /// when nginx is not installed. Retries on fresh ports when one given is taken.
    pub async fn start(ports: usize, servers: impl Fn(&[SocketAddr], &Path) -> String) -> Option<Self> {
        let binary = ["/usr/sbin/nginx", "/usr/bin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).exists())?;
        for _ in 0..5 {
            let dir = TempDir::new();
            let prefix = dir.path.display().to_string();
            let addrs: Vec<SocketAddr> = (0..ports)
                .map(|_| {
                    std::net::TcpListener::bind("127.0.0.1:0")
                        .unwrap()
                        .local_addr()
                        .unwrap()
                })
                .collect();
            let conf = format!(
                "user root;\nmaster_process off;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log;\n\
                 events {{ worker_connections 64; }}\n\
                 http {{\n  access_log off;\n  client_body_temp_path {prefix}/body;\n  proxy_temp_path {prefix}/proxy;\n\
                 \x20 fastcgi_temp_path {prefix}/fastcgi;\n  uwsgi_temp_path {prefix}/uwsgi;\n  scgi_temp_path {prefix}/scgi;\n\
                 {servers}\n}}\n",
                servers = servers(&addrs, &dir.path),
            );
            let conf_path = dir.path.join("nginx.conf");
            std::fs::write(&conf_path, conf).unwrap();
            let mut child = std::process::Command::new(binary)
                .arg("-p")
                .arg(&dir.path)
                .arg("-c")
                .arg(&conf_path)
                .args(["-g", "daemon off;"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .ok()?;
            let error_log = dir.path.join("error.log");
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut taken = false;
            let mut up = 0;
            while up < addrs.len() {
                let log = std::fs::read_to_string(&error_log).unwrap_or_default();
                if log.contains("Address already in use") {
                    taken = true;
                    break;
                }
                if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("nginx did not start: {log}");
                }
                if TcpStream::connect(addrs[up]).await.is_ok() {
                    up += 1;
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if taken {
                let _ = child.kill();
                let _ = child.wait();
                continue;
            }
            return Some(Nginx { addrs, child, dir });
        }
        panic!("nginx found its ports taken five times in a row");
    }

    /// Its directory: where the config may have put logs.
    pub fn dir(&self) -> &Path {
        &self.dir.path
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
